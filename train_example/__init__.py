"""End-to-end example: a byte-level MoE language model trained in MXFP8 and in BF16.

``python -m train_example.train`` trains one precision; ``python -m train_example.parity`` trains
both from the same seed and data and checks that MXFP8 matches BF16's loss curve.
"""
