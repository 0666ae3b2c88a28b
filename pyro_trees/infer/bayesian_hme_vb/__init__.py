"""Closed-form variational Bayes for the Bayesian hierarchical mixture of experts.

The public place of the whole closed-form path: the data and state containers, the
bound and the coordinate updates (:mod:`pyro_trees.models.bayesian_hme_vb_updates`, where
the variational family and the Jaakkola-Jordan bound are described), random starts,
annealing and the update loop (:mod:`pyro_trees.models.bayesian_hme_vb_run`), both kept
below the guides so that :class:`~pyro_trees.guides.BayesianHMEGuide` starts from them;
and, on top, the search over topologies (:mod:`.selection`) and the growing of solutions
into larger topologies (:mod:`.grow`).

References: C. M. Bishop and M. Svensén, *Bayesian Hierarchical Mixtures of Experts*,
UAI 2003; T. Jaakkola and M. Jordan, *Bayesian parameter estimation via variational
methods*, Statistics and Computing 10, 2000.
"""

from pyro_trees.infer.bayesian_hme_vb.grow import (
    grow_selection,
    grow_state,
    mirror_state,
    split_directions,
    split_gain,
)
from pyro_trees.infer.bayesian_hme_vb.selection import (
    ModelSelection,
    cycle_program,
    merge_selections,
    select_topology,
)
from pyro_trees.models.bayesian_hme_vb_run import (
    SCHEDULES,
    VBResult,
    fused_cycle,
    init_state,
    run_vb,
    schedule_by_name,
    temperature_schedule,
    vb_cycle,
)
from pyro_trees.models.bayesian_hme_vb_updates import (
    UPDATES,
    VBData,
    VBState,
    bound,
    expected_expert_loglik,
    expert_factor_terms,
    gate_factor_terms,
    gate_terms,
    jj_lambda,
    update_assignments,
    update_expert_precisions,
    update_experts,
    update_gate_precisions,
    update_gates,
    update_noise,
    update_xi,
)

__all__ = [
    "ModelSelection",
    "SCHEDULES",
    "UPDATES",
    "VBData",
    "VBResult",
    "VBState",
    "bound",
    "cycle_program",
    "expected_expert_loglik",
    "expert_factor_terms",
    "fused_cycle",
    "gate_factor_terms",
    "gate_terms",
    "grow_selection",
    "grow_state",
    "init_state",
    "jj_lambda",
    "merge_selections",
    "mirror_state",
    "run_vb",
    "schedule_by_name",
    "select_topology",
    "split_directions",
    "split_gain",
    "temperature_schedule",
    "update_assignments",
    "update_expert_precisions",
    "update_experts",
    "update_gate_precisions",
    "update_gates",
    "update_noise",
    "update_xi",
    "vb_cycle",
]
