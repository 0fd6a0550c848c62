"""Small shared helpers: atomic file writes, hashing, logging set-up."""
