/*
 * run_trunk.h - what k3-run reports about a model's trunk dtypes (--version
 * MODEL_DIR, --json): how many trunk tensors are stored as BF16, F16 and
 * F32, and whether k3-convert rounded any of them (--trunk-dtype bf16,
 * recorded in the manifest as lossy). Reads headers only.
 */
#ifndef K3_RUN_TRUNK_H
#define K3_RUN_TRUNK_H

#include <stdint.h>
#include <stdio.h>

#include "k3_err.h"

typedef struct k3_run_trunk {
    int packed;                 /* 1: packed model, 0: upstream checkpoint */
    uint32_t n[3];              /* trunk tensors stored as BF16, F16, F32 */
    uint32_t rounded;           /* of them rounded to BF16 by the converter */
} k3_run_trunk;

/* Fill t from dir's manifest.json, or from the headers of an upstream
 * checkpoint (the tensors the config expects). */
int k3_run_trunk_read(const char *dir, k3_run_trunk *t, k3_err *e);
/* One line of text (no newline at the end) and a JSON object. */
void k3_run_trunk_text(const k3_run_trunk *t, char *buf, size_t cap);
void k3_run_trunk_json(const k3_run_trunk *t, char *buf, size_t cap);

#endif
