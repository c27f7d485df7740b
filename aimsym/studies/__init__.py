"""Studies: sweeps over a grid, the resumable result store."""
