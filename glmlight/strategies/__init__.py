"""How the Trainer runs on the hardware: its accelerator, devices, strategy and loggers from the config
(trainer_setup.py), data-parallel collectives (distributed.py), FSDP2 (fsdp.py), DeepSpeed ZeRO (zero.py),
and the checkpoint files (checkpoint.py)."""
