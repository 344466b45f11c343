"""hpctrain.train"""
