"""hpctrain.plan"""
