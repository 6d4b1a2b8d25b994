"""The configuration: the typed schema and `validate` (schema.py; its rollout side: rollout.py), where each key's
range and allowed values sit on its field and each section's cross-key rules in its dataclass's `check`; the
field helpers and the walk that checks them (ranges.py: `field_range`; rules.py: `choice`, `check_config`), the
algorithm registry (registry.py), and composing a run's config from conf/ and overrides (compose.py)."""
