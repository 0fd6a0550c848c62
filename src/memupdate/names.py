"""The names every layer shares: the agent loops (``agent_name`` of a training row, verl's registry key), the
memory tools (``tools_kwargs``, the names the tools' schemas give the model) and a prepared model's manifest.

The data preparation writes them into rows, the settings check an experiment's tools against them, the memory
environment names the tools its policy is given, the agent loops register under them and the tools answer
to them. They are defined here, at the bottom of the package's layers (``tests/test_imports.py``), imported by
all, and this module imports nothing.
"""

MEMORY_AGENT, MEMAGENT_AGENT = "memupdate_agent", "memagent"

SEARCH_TOOL, MANAGE_TOOL, DELETE_TOOL = "search_memory", "manage_memory", "delete_memory"
MERGE_TOOL, SPLIT_TOOL, SAMPLE_TOOL = "merge_memory", "split_memory", "sample_memory"
MEMORY_TOOLS = (SEARCH_TOOL, MANAGE_TOOL, DELETE_TOOL, MERGE_TOOL, SPLIT_TOOL, SAMPLE_TOOL)

#: A prepared model's manifest (memupdate.models.prepare writes it, a training run's resume key reads it).
MODEL_MANIFEST = "memupdate_model.json"
