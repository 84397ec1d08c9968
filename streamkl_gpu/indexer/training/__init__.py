"""The indexer's training designs for scalar reductions with the teacher LSEs given, one file each:
``accumulate`` (the forward sums the target's share of the gradient), ``store`` (the forward keeps
p whole), ``chunk`` (the whole gradient in the forward, chunk by chunk); ``choice`` says which runs;
``row_weights`` checks the per-row weights a training step can take."""
