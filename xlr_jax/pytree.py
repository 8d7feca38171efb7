"""Frozen dataclasses that are JAX pytrees, as `flax.struct.dataclass` makes them, without
importing flax (~0.1-0.2 s of every process start)."""
import dataclasses

import jax


def pytree_dataclass(cls):
    """A frozen dataclass whose fields are all pytree children (None fields are empty
    subtrees), with `.replace(**changes)`."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = lambda self, **changes: dataclasses.replace(self, **changes)
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
