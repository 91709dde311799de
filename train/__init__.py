"""tether.train"""
