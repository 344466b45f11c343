"""hpctrain.checkpoint"""
