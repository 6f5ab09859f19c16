"""trainer.model"""
