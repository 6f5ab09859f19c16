"""trainer.ops"""
