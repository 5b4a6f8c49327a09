"""ds_autoplan inside training scripts it did not write: ``deepspeed --autoplan train.py`` and
``ds-autoplan launch train.py`` run every rank through :mod:`.bootstrap`, which installs
:mod:`.deepspeed_hook` around ``deepspeed.initialize`` and then runs the unchanged script;
Megatron-LM's ``pretrain_gpt.py``, patched with patches/megatron-lm-pretrain_gpt.patch, calls
:mod:`.megatron_lm`."""
