"""params"""
