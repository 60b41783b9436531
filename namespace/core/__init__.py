"""tfplan.core: the vocabulary every stage shares, at the bottom of the layers.

Typed errors (``errors``), JSON schema checks (``schema``), display units
(``units``), the hardware types (``cluster``: ``ClusterSpec``, ``DeviceSpec``,
``LinkSpec``) and the cluster presets (``presets``). Imports nothing above
itself and no TensorFlow.
"""
