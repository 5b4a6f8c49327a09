"""Runtimes that execute ds_autoplan schedules: deferred weight gradients (:mod:`.splitgrad`),
activation-memory accounting (:mod:`.memtrack`) and the DeepSpeed engine adapter
(:mod:`.deepspeed`)."""
