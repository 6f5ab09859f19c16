"""trainer.parallel"""
