"""meshpar: N-dimensional parallel training of large transformers from one TOML recipe.

Read in this order: ``recipe`` (TOML -> sections) -> ``mesh`` (degrees -> DeviceMesh) ->
``models`` (families on meta) -> ``parallelize`` (the fixed composition order) ->
``train`` (the step loop).
"""

__version__ = "0.1.0"
