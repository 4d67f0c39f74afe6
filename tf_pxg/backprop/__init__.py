"""Backpropagation over a recorded tape (a Python port of TF's imperative_grad)."""
