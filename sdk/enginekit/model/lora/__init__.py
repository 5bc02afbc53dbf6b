"""LoRA adapters: peft folders read and checked (``adapter``), their weights in the slots' layout (``weights``), the
device's adapter slots and the batched product of a step (``slots``), and a model's projections given those slots
(``model``)."""
