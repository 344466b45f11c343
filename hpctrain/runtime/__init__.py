"""hpctrain.runtime"""
