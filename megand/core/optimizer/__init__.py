"""Optimizer: AdamW with global grad norm and clipping, LR schedules."""

from megand.core.optimizer.lr_schedule import LRSchedule
from megand.core.optimizer.optimizer import Optimizer, StepResult
