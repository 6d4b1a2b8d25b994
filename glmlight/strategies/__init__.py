"""How the Trainer runs on the hardware: its accelerator, devices, strategy and loggers from the config
(trainer_setup.py), what an RL module reads of its strategy (base.py: RLStrategy), data-parallel collectives
and the unwrapped DDP strategy (distributed.py), FSDP2 (fsdp.py), DeepSpeed ZeRO (zero.py), the NPU plugin's
strategies in their RL form (npu.py), and the checkpoint files (checkpoint.py)."""
