"""Performance models and measurement: alpha-beta collective costs (Parm Eq. 12), hardware
profiles (YAML, `configs/hardware/`), Parm's schedule choice (Alg. 1), timing helpers."""
