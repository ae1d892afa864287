"""Generation backends behind one interface (HF ``generate`` here)."""
