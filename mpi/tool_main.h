/* mpi/tool_main.h - the tool's main under its MPI build's name (mpi/launch.c
 * calls it on rank 0). Included ahead of the tool's main.c by the Makefile. */
int k3_tool_main(int argc, char **argv);
