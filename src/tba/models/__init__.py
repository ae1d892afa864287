"""Model loading, sequence log-probs and the built-in demo model."""
