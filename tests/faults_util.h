/*
 * faults_util.h - what the fault-injection tests (t_faults.c, t_faults_run.c)
 * share: soft checks that report every failing cell before the test fails,
 * file and format probes that find the byte to hit, the fixture, and the
 * checks every cell makes. See t_faults.c for what the matrices prove.
 */
#ifndef K3_FAULTS_UTIL_H
#define K3_FAULTS_UTIL_H

#include <cjson/cJSON.h>
#include <stdint.h>

#define RUN_IDS "--ids 5,9,2,7 --gen 3 --threads 1"

typedef struct ft_packed {
    cJSON *man;
    uint8_t *idx;
    uint64_t idx_len;
} ft_packed;

typedef struct ft_fixture {
    char up[4096], pk[4096], pf[4096], sums[4096], out[4096];
} ft_fixture;

typedef struct ft_target {
    const char *what;
    char file[256]; /* basename (K3_FAULT's SUBSTR) */
    uint64_t off;
    int flip;       /* expected status for a flipped byte */
} ft_target;

/* failing cells so far in this test (each test runs in its own process) */
extern int ft_nbad;
extern const char *ft_kinds[3];

void ft_bad(const char *cell, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *ft_tail(const char *err);
char *ft_slurp(const char *path, uint64_t *len);
int ft_exists(const char *path);
void ft_join(char *out, const char *dir, const char *name);
uint64_t ft_first_char(const char *path, char c);
int ft_hexd(int c);
uint64_t ft_hash_digit(const char *path);
uint64_t ft_st_hlen(const char *path);
uint64_t ft_st_tensor_mid(const char *path, const char *sub);
uint64_t ft_st_offsets_digit(const char *path);
void ft_packed_open(ft_packed *p, const char *dir);
void ft_packed_close(ft_packed *p);
uint64_t ft_jnum(const cJSON *o, const char *k);
const char *ft_file_name(const ft_packed *p, uint64_t i);
int ft_nunits(const ft_packed *p);
uint64_t ft_unit_mid(const ft_packed *p, int u, const char **name);
uint32_t ft_le32(const uint8_t *b);
uint64_t ft_expert_byte(const ft_packed *p, uint32_t l, uint32_t e, const char **name);
void ft_first_expert(const char *pk, uint32_t *l, uint32_t *e);
void ft_fixture_make(ft_fixture *f, int repack);
void ft_clean(const char *dst);
void ft_one_error_line(const char *cell, const char *tool, const char *err, const char *file);
void ft_no_valid_output(const char *cell, const char *dst);
int ft_want_for(const ft_target *t, int kind);
void ft_tset(ft_target *t, const char *what, const char *file, uint64_t off, int flip);
int ft_upstream_targets(const ft_fixture *f, ft_target *t);
int ft_packed_targets(const char *dir, ft_target *t, const ft_fixture *f);

#endif
