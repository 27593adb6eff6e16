"""Weight-version policies (stash, double buffer, discrepancy correction, prediction, averaging) for the executors."""
