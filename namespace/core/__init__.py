"""tfplan.core: the vocabulary every stage shares, at the bottom of the layers.

Typed errors (``errors``), JSON schema checks (``schema``), display units
(``units``), the hardware types (``cluster``: ``ClusterSpec``, ``DeviceSpec``,
``LinkSpec``), the cluster presets (``presets``), atomic file writes and the
writability check of output locations (``atomic``) and sets of files replaced all at
once (``fileset``). Imports nothing above itself and no TensorFlow.
"""
