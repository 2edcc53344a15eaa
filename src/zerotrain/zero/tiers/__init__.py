"""tiers"""
