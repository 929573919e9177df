/*
 * t_trained.c - the fidelity gate on trained weights: models/kjv-tiny, a small
 * K3 trained on the King James Bible by train/train.py (PyTorch), shipped
 * with the PyTorch float64 log-probabilities of a held-out passage and its
 * greedy continuations of five prompts (reference.json).
 * tests/ref/trained_gate.py runs the NumPy float64 reference live and k3-run,
 * and requires: log-probabilities within 1e-4 relative (perplexity to 4
 * significant digits), greedy continuations identical, the runtime tokenizer
 * giving the training tokenizer's ids. No PyTorch is needed here.
 */
#include "k3_test.h"

#include <stdlib.h>
#include <string.h>

static const char *model_dir(void)
{
    static char p[4096];
    snprintf(p, sizeof p, "%s/models/kjv-tiny", k3t_root());
    return p;
}

K3_TEST(trained_model_files_match_their_sha256sums)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "cd %s && sha256sum --quiet -c SHA256SUMS", model_dir());
    if (rc != 0)
        fprintf(stderr, "%s%s", out ? out : "", err ? err : "");
    CHECK_EQ_INT(rc, 0);
    free(out);
    free(err);
    rc = k3t_runf(&out, &err, "k3-verify %s", model_dir());
    if (rc != 0)
        fprintf(stderr, "%s%s", out ? out : "", err ? err : "");
    CHECK_EQ_INT(rc, 0);
    free(out);
    free(err);
}

K3_TEST_TIMEOUT(trained_gate_upstream_checkpoint, 400)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "/usr/bin/python3 %s/tests/ref/trained_gate.py %s --k3-run %s/k3-run", k3t_root(),
                      model_dir(), k3t_bindir());
    fprintf(stderr, "%s%s", out ? out : "", err ? err : "");
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(out, "trained gate: pass");
    free(out);
    free(err);
}

/* The gate can fail: the reference run with the high nibble as the even
 * element (a swapped MXFP4 nibble order) as the candidate is rejected. */
K3_TEST_TIMEOUT(trained_gate_rejects_swapped_nibbles, 300)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err,
                      "/usr/bin/python3 %s/tests/ref/trained_gate.py %s --candidate k3ref --plant nibble_swap --no-greedy",
                      k3t_root(), model_dir());
    fprintf(stderr, "%s%s", out ? out : "", err ? err : "");
    CHECK_EQ_INT(rc, 1);
    CHECK_STR_CONTAINS(out, "trained gate: FAIL");
    free(out);
    free(err);
}

/* The packed model keeps the trunk as stored (F32 stays F32), so k3-run on it
 * passes the same gate, at the layout k3-pack makes for the RAM floor. */
K3_TEST_TIMEOUT(trained_gate_packed_model_at_the_floor, 400)
{
    const char *dir = k3t_tmpdir();
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s/packed --quiet", model_dir(), dir), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack %s/packed %s/floor --ram floor --quiet", dir, dir), 0);
    int rc = k3t_runf(&out, &err, "/usr/bin/python3 %s/tests/ref/trained_gate.py %s --k3-run %s/k3-run --run-model %s/floor",
                      k3t_root(), model_dir(), k3t_bindir(), dir);
    fprintf(stderr, "%s", out ? out : "");
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(out, "trained gate: pass");
    free(out);
    free(err);
}
