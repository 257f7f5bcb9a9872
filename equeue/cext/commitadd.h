/* The group commit's add in C (commitadd.c), for sendlane.c. */
#ifndef EQUEUE_COMMITADD_H
#define EQUEUE_COMMITADD_H
#include <Python.h>

#define COMMIT_SLOTS 9
typedef struct {
    PyTypeObject *type; /* the commit's type as last looked at (borrowed: compared only) */
    unsigned int tag;   /* its version tag then (0: none, looked at again every add) */
    int fast;           /* its add and _due are the ones C mirrors: C may add */
    Py_ssize_t at[COMMIT_SLOTS];
} CommitSlots;

/* Looks at commit's type: its slots' offsets and whether C may add to it. */
void commit_slots(PyObject *commit, CommitSlots *out);
/* commit.add(peer, request_id, result, messages): 1 done in C, 0 by the Python add, -1
 * with an error. slots: as commit_slots left them, looked at again when the type changed. */
int commit_add(PyObject *commit, CommitSlots *slots, PyObject *peer,
               PyObject *request_id, PyObject *result, PyObject *messages);
#endif
