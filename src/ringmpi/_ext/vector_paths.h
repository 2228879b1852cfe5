/* The vector-path registry shared by the compiled CPU loops (_fused, _fixed): paths(), path(),
 * use(name) and the choice at import.  Included after the module defines PATHS (entries with a
 * .name, widest first, the baseline last), N_PATHS, cpu_runs(i) (whether this CPU runs path i),
 * `static int current` (the path in use) and PATHS_OF (what the paths compute, for messages). */

/* the widest path this CPU runs (the baseline, last, always runs) */
static void use_widest(void)
{
    for (current = 0; !cpu_runs(current); current++)
        ;
}

/* the path named name, if this CPU runs it: 0, else -1 with ValueError set */
static int use_path(const char *name)
{
    for (int i = 0; i < N_PATHS; i++) {
        if (strcmp(name, PATHS[i].name) != 0) continue;
        if (!cpu_runs(i)) {
            PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s path of " PATHS_OF, name);
            return -1;
        }
        current = i;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "no vector path named '%s' (avx512, avx2, plain)", name);
    return -1;
}

static PyObject *py_paths(PyObject *self, PyObject *noargs)
{
    PyObject *out = PyTuple_New(0);
    for (int i = 0; out && i < N_PATHS; i++) {
        if (!cpu_runs(i)) continue;
        PyObject *name = PyUnicode_FromString(PATHS[i].name);
        if (!name || _PyTuple_Resize(&out, PyTuple_GET_SIZE(out) + 1) < 0) { Py_XDECREF(name); Py_XDECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, PyTuple_GET_SIZE(out) - 1, name);
    }
    return out;
}

static PyObject *py_path(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(PATHS[current].name); }

static PyObject *py_use(PyObject *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (use_path(name) < 0) return NULL;
    Py_RETURN_NONE;
}
