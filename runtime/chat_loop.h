/*
 * chat_loop.h - k3-run --chat (runtime/chat_loop.c), called from main.c.
 */
#ifndef K3_CHAT_LOOP_H
#define K3_CHAT_LOOP_H

/* 1 if argv asks for --chat. */
int k3_chat_wanted(int argc, char **argv);
/* The whole chat program: parses argv itself, returns the exit status. */
int k3_chat_main(int argc, char **argv);

#endif
