"""The names a training row carries: the agent loop that runs it (``agent_name``, verl's registry key)
and the tools it configures (``tools_kwargs``, by the names the tools' schemas give the model).

The data preparation writes them, the agent loops register under them and the tools answer to them; they
are defined here, imported by all, and this module imports nothing.
"""

MEMORY_AGENT, MEMAGENT_AGENT = "memupdate_agent", "memagent"

SEARCH_TOOL, MANAGE_TOOL, DELETE_TOOL = "search_memory", "manage_memory", "delete_memory"
MERGE_TOOL, SPLIT_TOOL, SAMPLE_TOOL = "merge_memory", "split_memory", "sample_memory"
MEMORY_TOOLS = (SEARCH_TOOL, MANAGE_TOOL, DELETE_TOOL, MERGE_TOOL, SPLIT_TOOL, SAMPLE_TOOL)
