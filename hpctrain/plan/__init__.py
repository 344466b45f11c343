"""``hpctrain plan``: which parallel plans fit a model on N ranks with M GB each.

Pure arithmetic, no communication: ``model_shape`` reads the model on the meta device,
``candidates`` lists the plans hpctrain's own checks accept, ``estimate`` prices each per
rank (ZeRO paper, Megatron activations), ``render`` prints the table, the command and the
TOML, ``command`` is the CLI; ``saved`` counts what autograd keeps for backward (used on
meta here and on real tensors by ``bench plan``).
"""
