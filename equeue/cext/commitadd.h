/* The group commit's add in C (commitadd.c), for sendlane.c. */
#ifndef EQUEUE_COMMITADD_H
#define EQUEUE_COMMITADD_H
#include <Python.h>

#define COMMIT_SLOTS 9
typedef struct {
    PyTypeObject *type; /* the commit's type the offsets are of; NULL: always Python's add */
    Py_ssize_t at[COMMIT_SLOTS];
} CommitSlots;

/* The offsets of commit's slots, or type NULL where its add must be the Python one. */
void commit_slots(PyObject *commit, CommitSlots *out);
/* commit.add(peer, request_id, result, messages): 1 done in C, 0 by the Python add, -1
 * with an error. */
int commit_add(PyObject *commit, const CommitSlots *slots, PyObject *peer,
               PyObject *request_id, PyObject *result, PyObject *messages);
#endif
