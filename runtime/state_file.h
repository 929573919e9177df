/*
 * state_file.h - k3-run's state files (--state-save / --state-load, and the
 * chat loop's): a sequence's state as the engine writes it
 * (k3_seq_state_save), the token ids it consumed, and a fingerprint of the
 * model, so a state is never continued on another model.
 *
 * Layout (little-endian), version 1:
 *   0   8  magic "K3STATE1"
 *   8   4  version (1)
 *   12  4  header bytes (72)
 *   16 32  model fingerprint (k3_state_fingerprint)
 *   48  4  n_ids: token ids the state has consumed (<= 2^24)
 *   52  4  CRC-32 of the ids
 *   56  8  S: bytes of the engine state
 *   64  4  CRC-32 of the engine state bytes
 *   68  4  CRC-32 of header bytes 0..67
 *   72     n_ids x u32 ids, then the S engine state bytes (their layout is
 *          k3_seq_state_save's in include/k3_engine.h)
 * The file is exactly 72 + 4 n_ids + S bytes; anything shorter is
 * truncated (K3_EIO), any other mismatch K3_EFORMAT, a CRC mismatch
 * K3_ECORRUPT, another model's fingerprint K3_EFORMAT naming both.
 * Written atomically (FILE.tmp, fsync, rename, fsync of the directory).
 */
#ifndef K3_STATE_FILE_H
#define K3_STATE_FILE_H

#include <stdint.h>

#include "k3_engine.h"
#include "k3_err.h"

#define K3_STATE_MAX_IDS (1u << 24)

/* SHA-256 naming the model of dir: over "k3-state-model-v1\n" and, for a
 * packed model, manifest.json's bytes (which carry every file's SHA-256, so
 * they name the weights exactly; a re-packed layout is another model here);
 * for an upstream checkpoint config.json's and model.safetensors.index.json's
 * bytes, then for each *.safetensors shard in name order its name, size and
 * 16 blocks of 4 KiB spread evenly over it (hashing 1.56 TB is not an
 * option: two checkpoints that differ only outside the sampled blocks look
 * the same). */
int k3_state_fingerprint(const char *dir, uint8_t fp[32], k3_err *e);

/* Write s's state and the ids it consumed (n_ids == k3_seq_pos(s)) to path;
 * an existing path is K3_EEXIST unless overwrite. */
int k3_state_save(const char *path, int overwrite, const uint8_t fp[32], const k3_seq *s, const uint32_t *ids,
                  uint32_t n_ids, k3_err *e);

/* Read path into s (whose max_ctx must hold it) after checking everything
 * above; *ids (heap, caller frees) and *n_ids receive the ids. On failure s
 * is unchanged. */
int k3_state_load(const char *path, const uint8_t fp[32], k3_seq *s, uint32_t **ids, uint32_t *n_ids, k3_err *e);

/* Check path's header, fingerprint (when fp is not NULL) and ids without
 * loading the state; *n_ids receives the count. */
int k3_state_peek(const char *path, const uint8_t fp[32], uint32_t *n_ids, k3_err *e);

/*
 * k3-run's prompt with state files. Before the prompt of n ids is computed:
 *   k3_state_use_load: the state of path goes into s if its ids are a
 *     proper prefix of ids (*reuse = their count: only the rest is computed);
 *     otherwise a warning on stderr and *reuse = 0. Another model's state, a
 *     truncated or corrupt file: the error.
 *   k3_state_use_save: computes ids[*reuse .. n-1) into s and saves the
 *     state of ids[0 .. n-1) to path; *reuse becomes n - 1. The last prompt
 *     id is left for the caller to compute, so that its logits come out
 *     (a continuation from the file computes at least that one id).
 */
int k3_state_use_load(const char *path, const char *model_dir, k3_seq *s, const uint32_t *ids, uint32_t n,
                      uint32_t *reuse, k3_err *e);
int k3_state_use_save(const char *path, int overwrite, const char *model_dir, k3_engine *en, k3_seq *s,
                      const uint32_t *ids, uint32_t n, uint32_t *reuse, k3_err *e);

#endif
