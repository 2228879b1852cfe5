"""The pure math of attention: dtypes, masks and score modifiers, dropout, the online softmax state,
layouts and positions, FLOP counts and the dense float64 reference.  No MPI, no backend, no I/O:
every other layer builds on these (docs/design.md)."""
