"""The stock script ported to the runtime: the import of Trainer is the one changed line."""

import os

from hf_resume_common import logged, model_and_data, parse, training_arguments
from transformers.trainer_utils import get_last_checkpoint

from elastic.hf import Trainer

args = parse()
model, train_set = model_and_data(args)
training_args = training_arguments(args)
last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
trainer = logged(Trainer)(model=model, args=training_args, train_dataset=train_set)
trainer.train(resume_from_checkpoint=last)
trainer.save_model()
