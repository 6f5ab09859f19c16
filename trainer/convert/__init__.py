"""trainer.convert"""
