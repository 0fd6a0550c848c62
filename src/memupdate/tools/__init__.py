"""verl ``BaseTool`` subclasses through which the policy reads and edits its trial memory store."""
