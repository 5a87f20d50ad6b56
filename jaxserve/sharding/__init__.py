"""Device mesh, logical-axis rules and partition specs (see mesh.py and rules.py)."""
