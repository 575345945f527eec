"""How a group averages: the flat butterfly (flat.py, owner side in flat_serving.py) and the grid
butterfly of a group past max_group_size (grid.py: shape in grid_shape.py, owner side in
grid_serving.py, its two stages' reductions in grid_reduction.py), both made of RoundMember
(member.py), parts (partition.py, reduction.py), streams (streams.py) and one registry that owns
every stream method's name (registry.py); bandwidth.py measures the links."""
