"""The job types both backends run: plain data that pickles, whose inputs a backend may swap for a stand-in."""

import dataclasses
import pickle

import numpy as np

from dp_core.keras import EvaluateJob, FitJob, Inputs, PredictJob, fit_arguments


@dataclasses.dataclass(frozen=True)
class StandIn:
    """What a worker replica holds in place of a source it does not read (as torch's ``SourceOnPrimary``)."""

    first: tuple
    num_batches: int | None

    def first_rows(self, count: int = 2):
        return self.first


def test_a_fit_job_pickles_with_its_options_and_reads_its_inputs_from_its_arguments():
    inputs = Inputs(np.arange(12.0).reshape(6, 2), np.arange(6.0))
    arguments = fit_arguments(inputs, global_batch_size=2, num_replicas=2, epochs=3, validation_split=0.5)
    job = FitJob(arguments, "global", "stop", lr_scaling="linear", warmup_steps=5, accumulate_steps=2)
    copy = pickle.loads(pickle.dumps(job))
    assert (copy.arguments.epochs, copy.batch_norm, copy.on_nonfinite_loss) == (3, "global", "stop")
    assert (copy.lr_scaling, copy.warmup_steps, copy.accumulate_steps) == ("linear", 5, 2)
    assert (copy.lr_policy, copy.resume_from, copy.profile, copy.shard) == (None, None, None, None)
    assert (copy.inputs.num_samples, copy.validation.num_samples) == (3, 3)
    x, y, _ = copy.inputs.rows(np.arange(3))
    np.testing.assert_array_equal(x, np.arange(6.0).reshape(3, 2))
    np.testing.assert_array_equal(y, [0.0, 1.0, 2.0])


def test_a_stand_in_takes_a_jobs_inputs_place():
    stand_in = StandIn(first=(np.zeros((2, 2)), None, None), num_batches=4)
    evaluate = dataclasses.replace(EvaluateJob(Inputs(np.zeros((4, 2))), 2, "global", 0), inputs=stand_in)
    predict = dataclasses.replace(PredictJob(Inputs(np.zeros((4, 2))), 2, 0), inputs=stand_in)
    assert evaluate.inputs.num_batches == predict.inputs.num_batches == 4
    assert (evaluate.log_every_steps, evaluate.callbacks, predict.callbacks) == (10, (), ())
    inputs = Inputs(np.zeros((4, 2)))
    job = FitJob(fit_arguments(inputs, global_batch_size=2, num_replicas=1, epochs=1), "global", "skip")
    swapped = dataclasses.replace(job, arguments=dataclasses.replace(job.arguments, inputs=stand_in))
    assert swapped.inputs is stand_in and swapped.validation is None
