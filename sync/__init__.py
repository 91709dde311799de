"""tether.sync"""
