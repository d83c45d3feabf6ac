"""Optimizer: the registered optimizers (AdamW, Muon, Lion: registry.py, one record each) on fp32 main
parameters (optionally sharded over dp x cp: the distributed optimizer), fp16 loss scaling, global grad norm
and clipping, LR schedules."""

from megand.core.optimizer.config import OptimizerConfig
from megand.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megand.core.optimizer.lr_schedule import LRSchedule
from megand.core.optimizer.optimizer import Optimizer, StepResult
