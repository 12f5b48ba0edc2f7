"""mirror_variables: every replica's copy of a variable starts from the master's value.

    replica_1/w/Assign(replica_1/w, <its own initial value>)
      becomes
    replica_1/w/Assign(replica_1/w, ReadVariableOp(w))  after ^w/Assign

so random initializers are drawn once. A checkpoint restore writes the master copy
(the Saver keeps the original names); the restore op then also copies the restored
values into every replica, so restoring never leaves the replicas apart.
"""

from graph_rewriter import opdefs
from graph_rewriter.analysis import DENSE_ASSIGNS, PASS_THROUGH
from graph_rewriter.op_builder import make_op
from graph_rewriter.pass_manager import Pass


class MirrorVariablesPass(Pass):
    name = "mirror_variables"
    requires = frozenset({"replicated", "plan"})
    ensures = frozenset({"variables_mirrored"})

    def run(self, graph, ctx):
        rm = graph.replicas
        if rm.num_replicas == 1:
            return False
        changed = False
        for vp in ctx.plan.variables:
            master = graph.node(vp.name)
            if not rm.is_cloned(graph, vp.name):
                continue
            if vp.initializer is not None:
                master_init = graph.node(vp.initializer)
                for i in range(1, rm.num_replicas):
                    init = rm.node(graph, i, vp.initializer)
                    pos = opdefs.input_position(init, "value")
                    value = _read(graph, master, f"{rm.prefixes[i]}{vp.name}/master_value",
                                  control_inputs=[master_init])
                    init.set_input(pos, value)
                    changed = True
            for restore in _restore_assigns(graph, rm, master):
                waiting = restore.control_consumers  # e.g. save/restore_all, before we add readers
                for i in range(1, rm.num_replicas):
                    copy = rm.node(graph, i, vp.name)
                    value = _read(graph, master, f"{rm.prefixes[i]}{vp.name}/restored_value",
                                  control_inputs=[restore])
                    sync = _assign(graph, copy, value, f"{rm.prefixes[i]}{vp.name}/sync_after_restore")
                    for c in waiting:
                        c.add_control_input(sync)
                    changed = True
        return changed


def _read(graph, var, name, control_inputs=()):
    if var.op == "VarHandleOp":
        return make_op(graph, "ReadVariableOp", name, [var.output(0)],
                       attrs={"dtype": var.attr["dtype"]}, control_inputs=control_inputs).output(0)
    # A ref is read where the variable lives: reading it from another device would send
    # the value when the step starts, before the control dependency lets it be written.
    return make_op(graph, "Identity", name, [var.output(0)], control_inputs=control_inputs,
                   colocate_with=[var]).output(0)


def _assign(graph, var, value, name):
    if var.op == "VarHandleOp":
        return make_op(graph, "AssignVariableOp", name, [var.output(0), value],
                       attrs={"dtype": var.attr["dtype"]})
    return make_op(graph, "Assign", name, [var.output(0), value],
                   type_attrs={"T": opdefs.base_dtype(var.attr["dtype"].type)})


def _restore_assigns(graph, rm, var):
    """Global (uncloned) assigns of the master variable: the Saver's restore ops."""
    out = []
    stack = [var]
    while stack:
        n = stack.pop()
        for c, pos in n.consumers(0):
            if c.op in PASS_THROUGH:
                stack.append(c)
            elif c.op in DENSE_ASSIGNS and pos == 0 and rm.replica_of(graph, c.name) is None:
                out.append(c)
    return out
