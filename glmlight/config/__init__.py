"""The configuration: the typed schema and `validate` (schema.py; its rollout side: rollout.py), each key's
value range (ranges.py) and allowed values with the cross-key rules (rules.py), the algorithm registry
(registry.py), and composing a run's config from conf/ and overrides (compose.py)."""
