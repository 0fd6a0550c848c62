"""verl agent loops: the MemoryUpdate tool loop (and, later, the recurrent MemAgent loop)."""
