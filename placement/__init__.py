"""tether.placement"""
