# runtime/module.mk - generated tables of the runtime.
#
# k3_unicode_tables.h: the tokenizer's character classes (docs/MODEL.md §5), written
# from Debian's unicode-data package (scripts/install-deps installs it).
UCD_DIR ?= /usr/share/unicode
UCD_FILES = $(UCD_DIR)/UnicodeData.txt $(UCD_DIR)/Scripts.txt $(UCD_DIR)/PropList.txt \
            $(UCD_DIR)/CaseFolding.txt

$(O)/gen/k3_unicode_tables.h: runtime/tok_unicode_gen.py $(UCD_FILES) | $(O)/gen
	/usr/bin/python3 runtime/tok_unicode_gen.py $(UCD_DIR) $@

GEN_HDR += $(O)/gen/k3_unicode_tables.h
