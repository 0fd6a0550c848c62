"""Extensions of verl 0.9.1 through its own registries, so its trainer runs on CPU machines: the ``cpu``
platform (:mod:`.cpu_platform`, with the device module it hands verl, :mod:`.cpu_device`) and the few
narrow patches where verl assumes an accelerator beyond what a platform answers (:mod:`.patches`).
Loaded in every process by :mod:`memupdate.verl_plugin`; inert unless the ``cpu`` platform is selected.
"""
